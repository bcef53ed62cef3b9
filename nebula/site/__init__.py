"""Running sites (docs/operate.md): the site config and its writer, the site builder, a site's service
specs, the supervisor, process identity, status, jobs, and a stage's channel and entry point at its site."""
