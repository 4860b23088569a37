"""The dataset catalog: versions with digests, read and register groups, and the jobs that used them."""
