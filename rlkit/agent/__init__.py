"""Multi-turn rollouts: tools and environments on TRL's contract (``tools``)."""
