# A VPC with private subnets for the fleet and public ones for the NAT gateway and the optional
# public load balancer. Bring your own VPC instead by passing its ids to the module.

data "aws_availability_zones" "available" {
  state = "available"
  # The zones are read once, at the first plan; the subnets created in them pin them after.
  #checkov:skip=CKV_AWS_394:the subnets fix the zones after the first apply; a new zone changes nothing unless zone_count grows
}

locals {
  zones = slice(data.aws_availability_zones.available.names, 0, var.zone_count)
}

resource "aws_vpc" "fleet" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true
  tags                 = { Name = "${var.name}-vpc" }

  #checkov:skip=CKV2_AWS_11:example network; enable VPC flow logs in the account's own VPC setup
}

# Lock down the default security group: nothing in this VPC should use it by accident.
resource "aws_default_security_group" "fleet" {
  vpc_id = aws_vpc.fleet.id
}

resource "aws_subnet" "private" {
  count             = length(local.zones)
  vpc_id            = aws_vpc.fleet.id
  availability_zone = local.zones[count.index]
  cidr_block        = cidrsubnet(var.vpc_cidr, 4, count.index)
  tags              = { Name = "${var.name}-private-${local.zones[count.index]}" }
}

resource "aws_subnet" "public" {
  count             = length(local.zones)
  vpc_id            = aws_vpc.fleet.id
  availability_zone = local.zones[count.index]
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, 200 + count.index)
  # Nothing launched here needs a public IP of its own: the NAT gateway has an Elastic IP and
  # the load balancer gets its addresses from AWS.
  map_public_ip_on_launch = false
  tags                    = { Name = "${var.name}-public-${local.zones[count.index]}" }
}

resource "aws_internet_gateway" "fleet" {
  vpc_id = aws_vpc.fleet.id
  tags   = { Name = "${var.name}-igw" }
}

resource "aws_route_table" "public" {
  vpc_id = aws_vpc.fleet.id
  tags   = { Name = "${var.name}-public" }
}

resource "aws_route" "public_internet" {
  route_table_id         = aws_route_table.public.id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.fleet.id
}

resource "aws_route_table_association" "public" {
  count          = length(aws_subnet.public)
  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public.id
}

# One NAT gateway keeps the example cheap (about $0.045/h plus traffic); it is a single point
# of failure for outbound traffic only (package and model downloads at boot). Use one per zone
# in production.
resource "aws_eip" "nat" {
  domain = "vpc"
  tags   = { Name = "${var.name}-nat" }
}

resource "aws_nat_gateway" "fleet" {
  allocation_id = aws_eip.nat.id
  subnet_id     = aws_subnet.public[0].id
  tags          = { Name = "${var.name}-nat" }

  depends_on = [aws_internet_gateway.fleet]
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.fleet.id
  tags   = { Name = "${var.name}-private" }
}

resource "aws_route" "private_nat" {
  route_table_id         = aws_route_table.private.id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.fleet.id
}

resource "aws_route_table_association" "private" {
  count          = length(aws_subnet.private)
  subnet_id      = aws_subnet.private[count.index].id
  route_table_id = aws_route_table.private.id
}
