from models.ranking import JaggedTokens, RankingModel, RankingModelConfig

__all__ = ["JaggedTokens", "RankingModel", "RankingModelConfig"]
