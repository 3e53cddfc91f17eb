"""mok inside the trainers people use. Each submodule imports its framework on import, so
import only the one you need:

- `mok.integrations.transformers`: registers the `"mok"` experts backend with Hugging Face
  transformers (`experts_implementation="mok"`).
- `mok.integrations.torchtitan`: torchtitan's `GroupedExperts` and `RoutedExperts` run by mok.
"""
