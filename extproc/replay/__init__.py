"""What-if replay of a traffic log: the router's decision code over a virtual fleet."""
