"""vlserve as a backend of NVIDIA Dynamo (`vlserve dynamo-worker`): see docs/dynamo.md."""
