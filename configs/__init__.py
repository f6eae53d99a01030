"""Training configs (`get_config()` -> ml_collections.ConfigDict), for `train.py --config`."""
