"""Running sites: the process supervisor, a site's services, bootstrap and status (docs/operate.md)."""
