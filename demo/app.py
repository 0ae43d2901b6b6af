"""Hugging Face Space entry point: the demo ships inside the package, as ``hf_specdec.demo.app``."""
from hf_specdec.demo.app import demo, main  # noqa: F401 (``demo``: what `gradio demo/app.py` serves)

if __name__ == "__main__":
    raise SystemExit(main())
