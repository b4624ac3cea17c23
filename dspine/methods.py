"""The decoding methods and drafter dtypes, named once (torch-free, so the command line can list them without loading
torch)."""

VARIANTS = {  # drafter method -> which layers inject ("all" | "last" | "none")
    "dflash": "none",
    "post_backbone": "last",
    "dspine": "all",
}
METHODS = ("ar", *VARIANTS)  # ar: the target alone
# what a drafter may decode in (checkpoint.draft_dtype)
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16", "float64", "int8")
