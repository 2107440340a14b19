"""Training configurations (ml_collections); variants import `default` and override a few fields."""
