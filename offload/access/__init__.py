"""Who may call the API: the API-key store (api_keys.py), below both the server that checks keys and the
autoscaler that mints a worker key for each machine it rents."""
