"""Projections of the log: the state services read, metrics computed on scrape, snapshots."""
