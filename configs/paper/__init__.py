"""Paper-scale configurations: the models and data of the papers the grids reproduce."""
