"""The browser playground: a static page served by the server itself (see routes.py)."""
