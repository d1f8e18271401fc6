"""Shipped reward functions for rlkit recipes (`rewards.<module>:<function>`)."""
