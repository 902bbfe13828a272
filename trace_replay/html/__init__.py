"""Self-contained HTML: GLTR-style token strips (``tokens``) and whole reports (``report``)."""
