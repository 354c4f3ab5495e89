"""Configuration: the server config, model configs in YAML and Triton's
pbtxt/JSON forms, and the typed readers they share. Validated once, here."""
