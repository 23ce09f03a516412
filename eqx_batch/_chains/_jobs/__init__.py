"""One job's processes: what they tell each other, and what makes two calls one run."""
