"""The decoding methods, named once (torch-free, so the command line can list them without loading torch)."""

VARIANTS = {  # drafter method -> which layers inject ("all" | "last" | "none")
    "dflash": "none",
    "post_backbone": "last",
    "dspine": "all",
}
METHODS = ("ar", *VARIANTS)  # ar: the target alone
