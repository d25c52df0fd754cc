"""Named models and data sets (pinned PyPI wheels, fetched once: registry.py, sharegpt.py) and the speculators
shipped for them (smollm2/)."""
