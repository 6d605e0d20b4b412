"""What a DeepSpeed training script imports to report progress and follow the aggregation plan."""
