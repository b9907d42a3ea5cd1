"""The ENGINE_PDL switch's name and values, torch-free: the launcher checks it before it imports
torch (``tgi_compat.launch_config``); ``kernels._pdl`` applies it."""

ENV_SWITCH = "ENGINE_PDL"
SWITCH_VALUES = {None: True, "": True, "1": True, "0": False}
