"""Episodes: multi-turn environment loops and outside agent harnesses."""
