"""GPU-hours, cost and utilisation per user, team, queue and profile, and the rollups they are read from."""
