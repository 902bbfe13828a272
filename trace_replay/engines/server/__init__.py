"""A running vLLM server: ``engine`` (the client engine, HTTP only), ``http_client``,
``answers`` (JSON to arrays), ``serve`` (the command that starts the server, and its contract).
"""
