"""Portal pages, one module per area: dashboard, jobs, usage, team."""
