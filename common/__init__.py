"""What every spotinfer process may import, and which imports none of them."""
