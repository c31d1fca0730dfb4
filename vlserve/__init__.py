"""vlserve: serving engine for vision-language models."""
