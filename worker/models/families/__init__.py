"""The families batchgen runs natively, one module each, and what they share
(``decoder_config.py``, ``switches.py``); ``registry.py`` lists them and finds one
by HF architecture."""
