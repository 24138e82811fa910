"""Node tooling: the disk-tier cleaner that runs on the nodes. Imports only api/."""
