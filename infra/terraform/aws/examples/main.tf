# Example: a small spotinfer fleet in a fresh VPC.
#
#   cp terraform.tfvars.example terraform.tfvars   # then set ami_id (docs/deploy.md)
#   terraform init && terraform apply

module "spotinfer" {
  source = "../"

  name               = var.name
  vpc_id             = aws_vpc.fleet.id
  private_subnet_ids = aws_subnet.private[*].id
  public_subnet_ids  = aws_subnet.public[*].id
  client_cidrs       = var.client_cidrs

  ami_id            = var.ami_id
  model             = var.model
  spotinfer_package = var.spotinfer_package

  worker_desired_count = var.worker_desired_count
  on_demand_base_count = var.on_demand_base_count
  fallback_max_count   = var.fallback_max_count

  # The module's NAT-dependent boot (pip, model download) needs the route in place first.
  depends_on = [aws_route.private_nat, aws_route_table_association.private]
}
