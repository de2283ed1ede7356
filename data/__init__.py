"""CTR datasets for the block-attention ranking models.

schema.py (FeatureSchema) and batch.py (Batch, collate) are the contract with models/;
datamodule.py (CTRDataModule) serves synthetic, Criteo and MovieLens-100K data.
Kept import-free so `import data.schema` stays cheap.
"""
