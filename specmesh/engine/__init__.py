"""The per-session KV-cache engine both services step: continuous batching, ragged and graph steps, the KV
budget, sessions, sampling and penalties, step costs. Imports model loading and the shared leaves, never the
server plumbing."""
