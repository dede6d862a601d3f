"""fivar's bundled variants: each file defines one `variant = AttentionVariant(...)`."""
