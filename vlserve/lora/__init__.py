"""LoRA adapters on every linear of the language model and the media towers: PEFT files read and checked
(`adapter`), linears that add each row group's adapter delta (`layers`; which rows take which adapter is
vlserve.model.layers.lora_rows), device slots filled on demand (`slots`) and the front end's catalogue of served
adapters (`catalog`)."""
