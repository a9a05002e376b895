"""What every part shares: manifest, parameters, features, task config, protocol messages."""
