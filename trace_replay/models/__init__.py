"""Models: the embedded default and user models resolved with nothing fetched (``load``),
and models loaded once per setting (``cache``)."""
