-- zdisk db: sysbench OLTP on the whitepaper's "modified schema" (seeds/003, Appendix 1):
-- sbtest plus two text columns filled with random lines of real text, and extra queries that
-- use them. --workload=read_write|write_only|read_only mirrors oltp_read_write.lua,
-- oltp_write_only.lua and oltp_read_only.lua; --text_file names the file of text lines
-- (written by zdisk db; one line per row fragment, no quotes or backslashes).
-- Works with the mysql and pgsql drivers.

require("oltp_common")

sysbench.cmdline.options.workload = {"read_write, write_only or read_only", "read_write"}
sysbench.cmdline.options.text_file = {"file of text lines for the t1/t2 columns", ""}
sysbench.cmdline.options.text_lines = {"most lines per text column", 3}
sysbench.cmdline.options.text_selects = {"text point selects per transaction", 2}
sysbench.cmdline.options.text_updates = {"text updates per transaction", 1}
sysbench.cmdline.options.table_options = {"extra CREATE TABLE options (e.g. ROW_FORMAT=COMPRESSED)", ""}

local lines = nil
local TEXT_MAX = 1000

local function load_lines()
   if lines ~= nil then return end
   lines = {}
   local f = assert(io.open(sysbench.opt.text_file, "r"), "cannot open --text_file")
   for l in f:lines() do
      if #l > 0 then lines[#lines + 1] = l end
   end
   f:close()
   assert(#lines > 0, "--text_file holds no lines")
end

function get_text()
   load_lines()
   local n = sysbench.rand.uniform(1, sysbench.opt.text_lines)
   local parts = {}
   local len = 0
   for i = 1, n do
      local l = lines[sysbench.rand.uniform(1, #lines)]
      if len + #l + 1 > TEXT_MAX then break end
      parts[#parts + 1] = l
      len = len + #l + 1
   end
   return table.concat(parts, " ")
end

function create_table(drv, con, table_num)
   local id_def = "INTEGER NOT NULL"
   local engine_def = ""
   local extra = sysbench.opt.table_options or ""
   if drv:name() == "mysql" then
      engine_def = "ENGINE = InnoDB"
   else
      extra = ""
   end
   print(string.format("Creating table 'sbtest%d'...", table_num))
   con:query(string.format([[
CREATE TABLE sbtest%d(
  id %s,
  k INTEGER DEFAULT '0' NOT NULL,
  c CHAR(120) DEFAULT '' NOT NULL,
  pad CHAR(60) DEFAULT '' NOT NULL,
  t1 VARCHAR(1000) DEFAULT '' NOT NULL,
  t2 VARCHAR(1000) DEFAULT '' NOT NULL,
  PRIMARY KEY (id)
) %s %s]], table_num, id_def, engine_def, extra))

   print(string.format("Inserting %d records into 'sbtest%d'", sysbench.opt.table_size, table_num))
   con:bulk_insert_init("INSERT INTO sbtest" .. table_num .. "(id, k, c, pad, t1, t2) VALUES")
   for i = 1, sysbench.opt.table_size do
      con:bulk_insert_next(string.format("(%d, %d, '%s', '%s', '%s', '%s')", i,
         sb_rand(1, sysbench.opt.table_size), get_c_value(), get_pad_value(), get_text(), get_text()))
   end
   con:bulk_insert_done()
   if sysbench.opt.create_secondary then
      print(string.format("Creating a secondary index on 'sbtest%d'...", table_num))
      con:query(string.format("CREATE INDEX k_%d ON sbtest%d(k)", table_num, table_num))
   end
end

local T = sysbench.sql.type

local function prepare_text(key, sql, types)
   for t = 1, sysbench.opt.tables do
      stmt[t][key] = con:prepare(string.format(sql, t))
      param[t][key] = {}
      for p, ty in ipairs(types) do
         if type(ty) == "table" then
            param[t][key][p] = stmt[t][key]:bind_create(ty[1], ty[2])
         else
            param[t][key][p] = stmt[t][key]:bind_create(ty)
         end
      end
      stmt[t][key]:bind_param(unpack(param[t][key]))
   end
end

-- Deletes and re-inserts rows with their text, so the data stays as compressible as loaded.
function prepare_delete_inserts()
   prepare_for_each_table("deletes")
   prepare_text("inserts_text", "INSERT INTO sbtest%u (id, k, c, pad, t1, t2) VALUES (?, ?, ?, ?, ?, ?)",
      {T.INT, T.INT, {T.CHAR, 120}, {T.CHAR, 60}, {T.VARCHAR, TEXT_MAX}, {T.VARCHAR, TEXT_MAX}})
end

function execute_delete_inserts()
   local tnum = sysbench.rand.uniform(1, sysbench.opt.tables)
   for i = 1, sysbench.opt.delete_inserts do
      local id = sysbench.rand.default(1, sysbench.opt.table_size)
      param[tnum].deletes[1]:set(id)
      local p = param[tnum].inserts_text
      p[1]:set(id)
      p[2]:set(sysbench.rand.default(1, sysbench.opt.table_size))
      p[3]:set(get_c_value())
      p[4]:set(get_pad_value())
      p[5]:set(get_text())
      p[6]:set(get_text())
      stmt[tnum].deletes:execute()
      stmt[tnum].inserts_text:execute()
   end
end

local function reads() return sysbench.opt.workload ~= "write_only" end
local function writes() return sysbench.opt.workload ~= "read_only" end

function prepare_statements()
   if not sysbench.opt.skip_trx then
      prepare_begin()
      prepare_commit()
   end
   if reads() then
      prepare_point_selects()
      if sysbench.opt.range_selects then
         prepare_simple_ranges()
         prepare_sum_ranges()
         prepare_order_ranges()
         prepare_distinct_ranges()
      end
      prepare_text("text_selects", "SELECT t1, t2 FROM sbtest%u WHERE id=?", {T.INT})
   end
   if writes() then
      prepare_index_updates()
      prepare_non_index_updates()
      prepare_delete_inserts()
      prepare_text("text_updates", "UPDATE sbtest%u SET t1=? WHERE id=?", {{T.VARCHAR, TEXT_MAX}, T.INT})
   end
end

local function execute_text_selects()
   local tnum = sysbench.rand.uniform(1, sysbench.opt.tables)
   for i = 1, sysbench.opt.text_selects do
      param[tnum].text_selects[1]:set(sysbench.rand.default(1, sysbench.opt.table_size))
      stmt[tnum].text_selects:execute()
   end
end

local function execute_text_updates()
   local tnum = sysbench.rand.uniform(1, sysbench.opt.tables)
   for i = 1, sysbench.opt.text_updates do
      param[tnum].text_updates[1]:set(get_text())
      param[tnum].text_updates[2]:set(sysbench.rand.default(1, sysbench.opt.table_size))
      stmt[tnum].text_updates:execute()
   end
end

function event()
   if not sysbench.opt.skip_trx then begin() end
   if reads() then
      execute_point_selects()
      if sysbench.opt.range_selects then
         execute_simple_ranges()
         execute_sum_ranges()
         execute_order_ranges()
         execute_distinct_ranges()
      end
      execute_text_selects()
   end
   if writes() then
      execute_index_updates()
      execute_non_index_updates()
      execute_delete_inserts()
      execute_text_updates()
   end
   if not sysbench.opt.skip_trx then commit() end
end
