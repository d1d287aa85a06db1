"""diffusers' image and video transformers (Flux, Wan, HunyuanVideo, CogVideoX, LTX-Video, Lumina 2, ...):
``rope-export export --diffusers DIR``.

* ``folders``: a pipeline folder (``model_index.json``) or one model's folder, its components, the model
  built offline with the folder's weights or random ones;
* ``recipes``: how each family's transformer is called (inputs at a latent size, dynamic axes, position
  inputs), and ``Denoiser``, the module the file is traced from;
* ``exporting``: ``export_diffusers`` (``export_module`` with the family's dynamic axes, then the file
  against diffusers at a latent size never traced);
* ``components``: a pipeline's VAE decoder and text encoders, exported as they are, rotations counted;
* the ``export --diffusers`` command runs in ``rope_export.cli.export_diffusers``.

diffusers is an optional extra (``pip install 'rope-export[diffusers]'``), imported when a model is built.
"""
