"""Deployment: the versioned Franka bundle (`dz package`), and later the policy server and client."""
