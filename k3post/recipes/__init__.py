"""What strings the stages together: demo (`k3post demo`: the whole pipeline, or the full recipe from
configs/full.yaml), experts (the nine domain x effort experts), evaluate (held-out pass rates), report (the HTML
report) and commands (every `k3post` command's wiring from a config). The stages themselves are `k3post.stages`.

Import the modules themselves (``from k3post.recipes import demo``); this package re-exports nothing."""
