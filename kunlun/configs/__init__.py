"""Run presets: Python files with ``get_config()`` (ml_collections ConfigDict)."""
