"""SGLang: the plugin (loaded inside SGLang), export, the per-release name check and the SGLang bench. sglang is
imported only here."""
