"""A stage for the jobs tests: the example workload's source, which also lists the files of its data
set ([job].data, opened through the site's grants) into its workdir."""
from __future__ import annotations

from services.example.stages import Source


class DataSource(Source):
    def __init__(self, context, options):
        super().__init__(context, options)
        files = sorted(p.name for p in context.data.iterdir())
        (context.workdir / "data-files.txt").write_text("\n".join(files) + "\n")
