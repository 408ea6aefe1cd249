"""Shipped configs; installed as `ushard.configs`, so `--config NAME` finds them from any directory."""
