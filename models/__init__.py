"""Model presets (TOML data files), shipped in the wheel as rope_export.models."""
