"""The reproduction grids, each run from the repository root as `python -m experiments.<grid>`;
their committed outputs are in results/."""
