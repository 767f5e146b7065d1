"""Example environments written against other libraries' APIs (each imports no rlpost)."""
