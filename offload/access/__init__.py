"""Who may call the API: the API-key store (api_keys.py), below both the server that checks every request's key
and the autoscaler that checks the worker key it hands each machine it rents."""
