"""Deployment: clients of the draft and target services, replica pools and failover, Ray and local backends, launch."""
