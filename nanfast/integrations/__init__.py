"""Callbacks that run `nanfast.watch` inside training frameworks: `nanfast.integrations.transformers`
(Hugging Face `Trainer`) and `nanfast.integrations.lightning` (Lightning `Trainer`). Each module imports
its framework, an optional extra: `pip install 'nanfast[transformers]'` or `'nanfast[lightning]'`.
They use the public API of the watch only (see docs/integrations.md)."""
