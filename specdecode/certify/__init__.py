"""`specdecode certify`: a statistical certificate that speculative sampling emits tokens distributed exactly as the
target says (docs/certify.md)."""
