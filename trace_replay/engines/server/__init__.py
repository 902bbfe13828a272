"""A running vLLM server: ``engine`` (the client engine, HTTP only), ``http_client``,
``responses`` (JSON to arrays), ``probe`` (the fingerprint), ``native`` (vLLM's own trace
replay, found at start-up), ``serve`` (the command that starts the server, and its contract).
"""
