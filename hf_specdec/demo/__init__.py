"""The Gradio demo (``hf-specdec demo``): ``app.py`` holds the handlers and the UI, ``panes.py`` draws the panes,
the plot and the summary. Importing this package imports nothing heavy; ``hf_specdec.demo.app`` needs gradio."""
