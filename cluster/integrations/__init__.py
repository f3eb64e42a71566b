"""Adapters that let RL frameworks drive raylane through their own contracts (verl)."""
